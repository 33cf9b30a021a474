"""lorastack gateway service."""

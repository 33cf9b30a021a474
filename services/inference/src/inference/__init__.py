"""lorastack inference service."""

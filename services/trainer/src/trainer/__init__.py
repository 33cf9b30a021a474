"""lorastack trainer service."""

"""lorastack merger service."""

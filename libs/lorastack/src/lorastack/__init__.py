"""lorastack: from a chat dataset to a served, checked LoRA model.

This package is the shared library every service uses: settings, the artifact store,
manifests, the error tree and logging. It owns no model code and no HTTP server.
"""

__version__ = "0.1.0"

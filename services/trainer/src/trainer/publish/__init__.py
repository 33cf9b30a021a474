"""What a run keeps and hands on.

Checkpoints and resuming, the artifact store, the completion record, hooks, and what a
failed run leaves behind. Stopping at a signal or the cost cap is trainer.loop.stopping.
"""

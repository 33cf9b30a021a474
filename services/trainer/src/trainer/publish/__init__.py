"""What a run keeps and hands on: checkpoints and resuming, the artifact store, the cost cap, the completion record, hooks, and what a failed run leaves behind."""

"""The training loop's parts, one module each, called in order by trainer.recipe.

gradients: one optimizer step's batches, backward and optimizer step. evaluation: the
validation loss and early stopping; selection: the pure arithmetic of both, and which
checkpoint a run publishes. stopping: stopping on SIGTERM / SIGINT and on the cost or time
cap; budget: that cap's arithmetic and its meter. progress: the step records and lines;
live: the live metrics and the progress bar. modes: the smoke and overfit runs.

Nothing here publishes: trainer.publish builds on this package, never the reverse.
"""

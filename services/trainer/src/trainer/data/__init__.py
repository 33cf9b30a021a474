"""The data a run trains on.

Reading and checking dataset files, splits, samples through the chat template, encoding,
masking, packing and batch order.
"""

"""Fine-tuning data: prompt/response and chat examples, loss masking, packing.

``examples`` turns a record into tokens and labels; ``loader`` is the ``finetuning`` entry of
the ``dataloaders`` registry.
"""

"""Parameter-efficient fine-tuning applied from outside the model code: LoRA (``model.peft_config``)."""

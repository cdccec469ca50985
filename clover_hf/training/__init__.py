"""Training heads: data, self-distillation, cached features, packing, the trainer and the pipeline."""

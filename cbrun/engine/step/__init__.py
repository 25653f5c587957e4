"""One step of the model: the batch builder, the forward, the attention hook, sampling and scoring."""

"""One model step: the forward batch, the model runner and the batch executor."""

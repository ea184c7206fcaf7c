"""Memory: the learned micro-batch limit, the peak-memory predictor, out-of-memory recovery inside a
step and the records that carry a limit across a restart. Imports only the distributed layer and the
door to DeepSpeed's internals."""

"""The recurrent layers' kernels of the hybrid models (Gated DeltaNet, Mamba2): conv.py, gated_delta.py, ssd.py in
torch, the batch entry over state slots in segments.py, Triton decode steps in triton_steps.py (imported only
where triton is)."""

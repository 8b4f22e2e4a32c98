"""Weight quantization: our quantizers (RTN, GPTQ, AWQ, SmoothQuant), HF checkpoint formats, FP8 / W8A8 weights."""

"""Engine-side model definitions built from quantized linear and MoE modules."""

"""Layer: actuators (no SGLang import). Ways the scaling controller adds and removes instances."""

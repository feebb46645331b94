"""Layer: plugin tooling (no SGLang import). Drafter training for DSpark: data, trainer, checkpoint export."""

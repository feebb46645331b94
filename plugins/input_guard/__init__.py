"""input_guard: refuse prompts SGLang would crash on (token ids outside the vocabulary) with a 400."""

"""Quality evaluation (installed as ``oscar_hf.eval``): perplexity, needle-in-a-haystack, attention KL, method comparison,
lm-eval adapter; and the demo and test models' loaders (:mod:`.models`)."""

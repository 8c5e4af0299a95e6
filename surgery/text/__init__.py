"""The text models are measured on: the pinned built-in corpus and the model's own samples (corpus), cut into token
windows with disjoint calibration and evaluation parts (data)."""

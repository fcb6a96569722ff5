"""Engine: sequences, sampling, the model runner and the offline LLM API."""

"""Statistics of models on windows: the scoring graph and its session (scoring), loss, dNLL and KL with intervals
(statistics), llama.cpp's KL statistics (quality), latency (timing). Numbers only: report/ formats them."""

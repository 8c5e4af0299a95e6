"""The jobs: the main job (`parallelize --layers auto`), its greedy selection and trials, explicit --layers rewrites."""

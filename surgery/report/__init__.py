"""Presentation: the main job's summary lines and diagnose's report (report.json / .md / .html and plots)."""

"""Health and scaling: ``hvdrun check`` (can these hosts run a job?) and ``hvdrun bench`` (how does it scale?)."""

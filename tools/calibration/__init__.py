"""The planner's calibration: its predictions against measured runs."""

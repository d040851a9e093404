"""Workers: own the model and every device array; run steps the engine core schedules."""

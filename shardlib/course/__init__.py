"""The course around the library: lab generation from the solutions."""

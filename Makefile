# Shortcuts for people who like make; each calls course.py, which does the work.
PYTHON ?= python3

.PHONY: course test labs

course:  ## set up .venv if needed and open the course in JupyterLab
	$(PYTHON) course.py

test:  ## set up .venv if needed and run every test (pytest + notebooks)
	$(PYTHON) course.py test

labs:  ## regenerate labs/ from solutions/
	$(PYTHON) course.py labs

# Shortcuts for people who like make; each calls course.py, which does the work.
PYTHON ?= python3

.PHONY: course test test-fast test-gpu labs site

course:  ## set up .venv if needed and open the course in JupyterLab
	$(PYTHON) course.py

test:  ## set up .venv if needed and run every test (pytest + notebooks)
	$(PYTHON) course.py test

test-fast:  ## the fast tier: library tests without notebooks or long launches
	$(PYTHON) course.py test -m "not slow"

test-gpu:  ## the tests that need CUDA GPUs (skipped without them)
	$(PYTHON) course.py test -m gpu

labs:  ## regenerate labs/ from solutions/
	$(PYTHON) course.py labs

site:  ## build the course's website from the executed notebooks into build/site
	$(PYTHON) course.py site

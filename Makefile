# shift-lightning: the commands of the README.
MODEL ?= smollm2-135m
PY ?= .venv/bin/python

.PHONY: reproduce
reproduce:  ## the paper's tables for MODEL (resumable; many CPU-hours)
	$(PY) -m shift_lightning.recipes.reproduce --model $(MODEL)

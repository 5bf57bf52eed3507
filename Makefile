.PHONY: setup run demo test lint typecheck pytest bench
VENV := .venv/bin

setup:
	bash scripts/setup.sh

## The service on the embedded defaults (fresh machine: this is all you need).
run: setup
	bash scripts/serve.sh

## The CLI round trip: keygen, generate, decode, detect.
demo: setup
	bash scripts/demo.sh

## Every test, plus lint and types (what CI runs).
test: setup lint typecheck pytest

lint:
	$(VENV)/ruff check .
	$(VENV)/ruff format --check .

typecheck:
	$(VENV)/mypy

pytest:
	bash scripts/pytest.sh

bench: setup
	$(VENV)/worldcup bench

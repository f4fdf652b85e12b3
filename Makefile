.PHONY: install lint typecheck test bench demo

install:
	python3 -m venv .venv && .venv/bin/pip install -e '.[test,dev,demo]'

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check bus_redis session_store worker gateway

typecheck:
	.venv/bin/mypy

test:
	bash scripts/test.sh

bench:
	.venv/bin/python bench/turns.py

demo:
	.venv/bin/agent-worker demo

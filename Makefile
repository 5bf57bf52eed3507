.PHONY: setup setup-vllm run demo test test-vllm test-container test-serve test-cluster lint typecheck pytest bench soak fuzz console-screenshots gpu-bundle
VENV := .venv/bin

setup:
	bash scripts/setup.sh

## .venv-vllm: the project plus vLLM's CPU build (kept apart: the base install stays fast).
setup-vllm:
	bash scripts/setup-vllm.sh

## The service on the embedded defaults (fresh machine: this is all you need).
## `make run ENGINE=vllm` serves on vLLM from .venv-vllm instead.
ENGINE ?= hf
run: $(if $(filter vllm,$(ENGINE)),setup-vllm,setup)
	WORLDCUP_ENGINE=$(ENGINE) WORLDCUP_VENV=$(if $(filter vllm,$(ENGINE)),.venv-vllm,.venv) bash scripts/serve.sh

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

## The vLLM engine's tests (pytest mark `vllm`) in .venv-vllm; CI runs them after `make test`.
test-vllm: setup-vllm
	WORLDCUP_VENV=.venv-vllm bash scripts/pytest.sh tests/test_engines.py tests/test_vllm_processor.py -m vllm -p no:cacheprovider

## The container images, built with podman and started for real: /ready, tenants,
## generate/decode, non-root, secrets from files, the cache volume reused, and the compose
## stack (app + Redis) through restarts. Installs podman & co. when missing (never skips);
## CI runs it after make test-vllm. See scripts/container-test.sh and docs/deployment.md.
test-container: setup
	bash scripts/container-test.sh

## The service on Ray Serve (pytest mark `serve`): two local Ray nodes (ports from
## WORLDCUP_TEST_RAY_PORT_BASE, default 21300-21399), two replicas on the embedded model and
## Redis; round trips through the proxies, a replica killed under load, a downscale under load.
test-serve: setup
	bash scripts/pytest.sh tests/test_serve.py -m serve -p no:cacheprovider -s

## The Redis store on a real Redis Cluster (pytest mark `cluster`): six local
## redis-server processes (ports 21201-21206, bus +10000; WORLDCUP_TEST_CLUSTER_PORT
## moves them); the store contract, a service round trip, a failover soak and the
## migration. A missing redis-server fails, never skips.
test-cluster: setup
	bash scripts/pytest.sh tests/test_store_contract.py tests/test_registry_store.py tests/test_redis_buckets.py tests/test_redis_cluster.py tests/test_probe_accounts.py -m cluster -p no:cacheprovider

bench: setup
	$(VENV)/worldcup bench speed

## The GPU service check's offline bundle in gpu-bundle/ (ignored, never committed): the
## project wheel, the service's wheels a CUDA host lacks (cp312), the embedded model, in
## parts of <= 64 MiB, loads of <= 27 MiB, sha256 manifest. Then on the GPU host:
## `bash scripts/gpu_service_check.sh` (`--dry-run` here; make test runs it).
gpu-bundle: setup
	$(VENV)/python scripts/gpu_service_check.py build --out gpu-bundle

## Several thousand mixed requests against the real service and a private redis-server,
## which is SIGKILLed mid-run and restarted; exits non-zero on any violation.
soak: setup
	$(VENV)/python scripts/soak.py --requests 4000 --concurrency 16 --outage

## Longer schemathesis fuzz of every OpenAPI operation with every check (real app, tiny
## model, Redis at 127.0.0.1:6379), a fresh random seed each run (printed; replay with
## WORLDCUP_FUZZ_SEED=N); `make test` runs the same test with 25 examples and seed 0.
fuzz:
	WORLDCUP_FUZZ_RANDOM=1 WORLDCUP_FUZZ_EXAMPLES=$${WORLDCUP_FUZZ_EXAMPLES:-300} bash scripts/pytest.sh tests/test_fuzz.py -q -s -p no:cacheprovider

## The console's screenshots in docs/console/ (verdicts, a case, the batch table, the
## printed report), taken by its browser tests against the real app.
console-screenshots: setup
	WORLDCUP_CONSOLE_SCREENSHOTS=docs/console bash scripts/pytest.sh tests/test_console_browser.py tests/test_console_cases_browser.py -q -p no:cacheprovider

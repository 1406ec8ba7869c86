"""The submission stage: what reaches the platform. `render` (Dockerfile, run config, apply.sh), `wheels` (the
in-image step's offline wheels), `build` (the committed repository and its payload), `check` (the repository is
what the platform needs), `inimage` (the step the Docker build runs: it imports only the engine and what it needs,
never the host-only modules here) and `image` (the Docker flow). It may import every earlier stage (recipe,
transforms, engine, lint); runtime, bench and the CLI come after it.

This file stays empty of imports: it is part of the in-image step's import closure."""

from conflux_jax.checkpoints.convert import main

raise SystemExit(main())

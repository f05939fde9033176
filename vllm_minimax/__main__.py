from vllm_minimax.cli import main

raise SystemExit(main())

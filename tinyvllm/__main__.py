from tinyvllm.cli import main

raise SystemExit(main())

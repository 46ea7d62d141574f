from kvtierd.cli import main

raise SystemExit(main())

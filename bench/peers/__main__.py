from bench.peers.run import main

raise SystemExit(main())

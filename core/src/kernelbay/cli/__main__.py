"""``python -m kernelbay.cli``."""

from kernelbay.cli import main

raise SystemExit(main())

import sys

from jaxinfer_tools.bench.run import main

sys.exit(main())

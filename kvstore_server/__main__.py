import sys

from kvstore_server.main import main

sys.exit(main())

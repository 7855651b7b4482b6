from kvstore_server.main import main
import sys

sys.exit(main())

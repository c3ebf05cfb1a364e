import sys

from sgl_remote_kv.admin.cli import main

sys.exit(main())

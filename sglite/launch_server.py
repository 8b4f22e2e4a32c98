"""``python -m sglite.launch_server --model-path P --port 30000``: same flags as ``sglite serve``."""
from sglite.server.launch import main

if __name__ == "__main__":
    main()

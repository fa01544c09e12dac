from omniflow.cli import main

main()

from cluster.cli import main

main()

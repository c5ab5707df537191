from nanograph.serve.cli import main

main()

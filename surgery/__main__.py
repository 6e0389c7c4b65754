from surgery.cli import main

main()

from akunu.cli.app import main

main()

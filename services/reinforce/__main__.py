from reinforce.cli import main

main()

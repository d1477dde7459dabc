from reinforce.environment.server import main

main()
